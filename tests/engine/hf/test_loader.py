"""The hf engine's loader on a real checkpoint (the tiny one, as `djev serve` loads it: from_pretrained,
then onto the device): the decoder's layers stay the encoder's, and no weight is loaded twice."""

from __future__ import annotations

from safetensors import safe_open

from app.engine.hf.parts import decoder_layers, encoder_layers
from tests.conftest import make_tiny_reader


def test_the_loaded_decoder_is_the_encoder_and_no_weight_is_held_twice(tiny_dir):
    model = make_tiny_reader(tiny_dir).runner.model
    for encoder, decoder in zip(encoder_layers(model), decoder_layers(model), strict=True):
        decoder_params = dict(decoder.named_parameters())
        for name, param in encoder.named_parameters():
            assert param.data_ptr() == decoder_params[name].data_ptr(), name
    embeddings = model.model.decoder.embed_tokens.weight
    assert model.model.encoder.language_model.embed_tokens.weight.data_ptr() == embeddings.data_ptr()
    assert model.lm_head.weight.data_ptr() == embeddings.data_ptr()

    # The checkpoint holds each unique weight once (its tied names are not written): the loaded
    # parameters hold exactly those bytes, each weight in one storage of its own.
    parameters = dict(model.named_parameters(remove_duplicate=False))
    with safe_open(str(tiny_dir / "model.safetensors"), "pt") as checkpoint:
        saved = {name: checkpoint.get_tensor(name).nbytes for name in checkpoint.keys() if name in parameters}
    held = {param.untyped_storage().data_ptr(): param.untyped_storage().nbytes() for param in model.parameters()}
    assert len(held) == len(saved) and sum(held.values()) == sum(saved.values())
    # ... while its names, counted each on its own, would hold the tied layers twice over.
    assert sum(param.nbytes for param in parameters.values()) > 1.5 * sum(held.values())
