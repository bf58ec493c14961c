"""The vLLM engines' shared pieces without vLLM: request fields, label-id splitting, parsing vLLM's
logprobs (and refusing answers that do not fit), prompts cut back into chat messages, settings."""

from __future__ import annotations

import math

import pytest

from app.build import CheckpointError, build_reader
from app.cli import build_parser, settings_from_args
from app.config import Settings
from app.engine.base import GenerateSpec, ImageInput, Prompt, ReadSpec
from app.engine.vllm.chat import IMAGE_PART, ChatForm, ChatFormer
from app.engine.vllm.checkpoint import CheckpointConfig, load_tokenizer
from app.engine.vllm.wire import (
    ChunkCutter,
    UpstreamAnswerError,
    collapse_images,
    label_id_groups,
    merge_answers,
    parse_chat_read,
    parse_completion_read,
    read_result,
    read_results,
)


def spec(label_ids=((5, 6), (7, 8)), steps=1) -> ReadSpec:
    return ReadSpec(Prompt((1, 2, 3)), ((9,) * 16,), (2, 4), label_ids, steps, 0)


def completion(width: int, ids, argmax=3) -> dict:
    tops = [{f"token_id:{i}": -1.0 - i / 100 for i in ids} for _ in range(width)]
    return {"choices": [{"logprobs": {"tokens": [f"token_id:{argmax}"] * width, "top_logprobs": tops}}],
            "usage": {"prompt_tokens": 3}}


def test_label_ids_are_sorted_distinct_and_split_at_the_cap():
    labels = (tuple(range(300, 45, -1)), (46, 47))
    groups = label_id_groups(spec(labels), 128)
    assert [len(g) for g in groups] == [128, 127]
    assert list(groups[0] + groups[1]) == list(range(46, 301))


def test_a_completion_answer_becomes_slot_reads():
    answer = parse_completion_read(completion(16, [5, 6, 7, 8], argmax=42))
    result = read_result(spec(), [answer])
    assert result.slots[0][0].label_logprobs == (-1.05, -1.06) and result.slots[0][1].argmax_id == 42
    assert result.prompt_tokens == 3


def test_split_answers_merge_into_one():
    first = parse_completion_read(completion(16, [5, 6]))
    second = parse_completion_read(completion(16, [7, 8]))
    result = read_result(spec(), [merge_answers([first, second])])
    assert result.slots[0][1].label_logprobs == (-1.07, -1.08)


def test_a_chat_answer_becomes_slot_reads():
    content = [{"token": "token_id:11", "logprob": -0.1,
                "top_logprobs": [{"token": f"token_id:{i}", "logprob": -float(i)} for i in (5, 6, 7, 8)]}] * 6
    answer = parse_chat_read({"choices": [{"logprobs": {"content": content}}], "usage": {"prompt_tokens": 9}})
    result = read_result(spec(), [answer])
    assert result.slots[0][0].label_logprobs == (-5.0, -6.0) and result.slots[0][0].argmax_id == 11


@pytest.mark.parametrize("answer, words", [
    ("not an object", "not a JSON object"),
    ({"choices": []}, "no choices"),
    ({"choices": [{"text": "x"}]}, "no logprobs"),
    ({"choices": [{"logprobs": {"tokens": ["token_id:1"], "top_logprobs": []}}]}, "differ in length"),
    ({"choices": [{"logprobs": {"tokens": ["hello"], "top_logprobs": [{}]}}], "usage": {"prompt_tokens": 1}},
     "token_id:<id>"),
    ({"choices": [{"logprobs": {"tokens": ["token_id:1"], "top_logprobs": [{"token_id:1": "x"}]}}]}, "a number"),
    ({"choices": [{"logprobs": {"tokens": [], "top_logprobs": []}}]}, "usage.prompt_tokens"),
])
def test_answers_that_do_not_fit_are_refused_with_the_reason(answer, words):
    with pytest.raises(UpstreamAnswerError) as caught:
        parse_completion_read(answer)
    assert words in str(caught.value)


def test_a_missing_position_or_label_is_refused():
    short = parse_completion_read(completion(3, [5, 6, 7, 8]))
    with pytest.raises(UpstreamAnswerError, match="slot 4 is past them"):
        read_result(spec(), [short])
    partial = parse_completion_read(completion(16, [5, 6]))
    with pytest.raises(UpstreamAnswerError, match=r"no logprob for label ids \[7, 8\]"):
        read_result(spec(), [partial])


def test_a_minus_infinity_logprob_is_a_number():
    answer = parse_completion_read(completion(16, [5, 6, 7, 8]))
    answer.logprobs[2][5] = -math.inf
    assert read_result(spec(), [answer]).slots[0][0].label_logprobs[0] == -math.inf


def test_one_calls_answers_are_cut_back_per_spec_in_order():
    one, two = spec(), ReadSpec(Prompt((1,)), ((9,) * 16,) * 2, (2, 4), ((5, 6), (7, 8)), 1, 0)
    answers = [parse_completion_read(completion(16, [5, 6, 7, 8], argmax=token)) for token in (40, 41, 42)]
    first, second = read_results([one, two], answers)
    assert [reads[0].argmax_id for reads in first.slots] == [40]
    assert [reads[0].argmax_id for reads in second.slots] == [41, 42]


def generation(max_tokens=10, stops=(0,)) -> GenerateSpec:
    return GenerateSpec(Prompt((1, 2, 3)), max_tokens, stops, seed=0)


def test_generated_pieces_are_cut_at_a_stop_id():
    cutter = ChunkCutter(generation())
    first = cutter.chunk([5, 6], False, None)
    assert first.ids == (5, 6) and not first.done and first.prompt_tokens == 3
    last = cutter.chunk([7, 0, 8], False, None)
    assert last.ids == (7,) and last.done and last.stopped


def test_generated_pieces_keep_within_max_tokens_and_end_when_vllm_finishes():
    cutter = ChunkCutter(generation(max_tokens=3))
    cutter.prompt_tokens = 9
    assert cutter.chunk([5, 6], False, None).ids == (5, 6)
    last = cutter.chunk([7, 8], True, "length")
    assert last.ids == (7,) and last.done and not last.stopped and last.prompt_tokens == 9
    assert cutter.chunk([], True, "stop").stopped
    end = cutter.end()
    assert end.ids == () and end.done and not end.stopped and end.prompt_tokens == 9


def test_the_checkpoint_config_holds_what_the_tokenizer_and_engines_need(tiny_dir):
    config = CheckpointConfig.read(tiny_dir)
    tokenizer, _ = load_tokenizer(tiny_dir, config)
    assert config.sliding_window == 64 and config.vocab_size == tokenizer.vocab_size
    assert config.image_id == tokenizer.image_placeholder_id and config.boi_id != config.eoi_id


def test_collapse_images_puts_one_placeholder_back_per_image():
    assert collapse_images([1, 9, 10, 10, 10, 11, 2, 9, 10, 11], 10, 9, 11) == [1, 10, 2, 10]


@pytest.fixture(scope="module")
def former(tiny_dir):
    tokenizer, raw = load_tokenizer(tiny_dir, CheckpointConfig.read(tiny_dir))
    return tokenizer, ChatFormer(tokenizer, tokenizer.image_placeholder_id)


@pytest.mark.parametrize("thinking", [False, True])
def test_a_rendered_prompt_is_cut_back_into_its_messages(former, thinking):
    tokenizer, chat = former
    ids = tokenizer.render_chat("Question q1: is it?", "a photo <turn|> of a cat", 2, thinking)
    form = chat.form(Prompt(tuple(ids)))
    assert not form.continue_final and form.thinking is thinking
    assert form.messages == ({"role": "system", "content": "Question q1: is it?"},
                             {"role": "user", "content": [IMAGE_PART, IMAGE_PART, "a photo <turn|> of a cat"]})
    image = ImageInput(b"\x89PNG", "image/png")
    fields = form.request_fields([image, image])
    assert fields["messages"][1]["content"][0] == {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw=="}}
    assert fields["chat_template_kwargs"] == {"enable_thinking": thinking}


def test_an_opened_thought_is_sent_as_an_assistant_message_to_continue(former):
    tokenizer, chat = former
    ids = tokenizer.render_chat("Sheet.", "state", 1, thinking=True) + list(tokenizer.thought_open)
    form = chat.form(Prompt(tuple(ids)))
    assert form.continue_final and form.messages[-1] == {"role": "assistant", "content": "<|channel>thought\n"}
    fields = form.request_fields([ImageInput(b"x", "image/jpeg")])
    assert fields["continue_final_message"] is True and fields["add_generation_prompt"] is False


def test_a_prompt_that_is_not_a_chat_is_refused(former):
    tokenizer, chat = former
    with pytest.raises(Exception) as caught:
        chat.form(Prompt(tuple(tokenizer.encode("plain text, no turns"))))
    assert "cannot go through vLLM's chat route" in str(caught.value)


def test_upstream_is_a_list_setting_from_flags_and_env():
    args = build_parser().parse_args(["serve", "--engine", "remote", "--upstream", "http://a:1", "--upstream", "http://b:2"])
    assert settings_from_args(args).remote.upstream == ("http://a:1", "http://b:2")
    assert Settings.from_env({"UPSTREAM": "http://a:1, http://b:2"}).remote.upstream == ("http://a:1", "http://b:2")


@pytest.mark.parametrize("env, words", [
    ({"ENGINE": "remote"}, "ENGINE remote needs at least one UPSTREAM"),
    ({"UPSTREAM": "a:1"}, "must start with http://"),
    ({"UPSTREAM_READ_TIMEOUT": "0"}, "UPSTREAM_READ_TIMEOUT must be more than 0"),
    ({"MAX_MODEL_LEN": "100"}, "MAX_MODEL_LEN more than CANVAS"),
    ({"GPU_UTIL": "1.5"}, "GPU_UTIL must be in (0, 1]"),
    ({"ENGINE": "vlm"}, "ENGINE must be one of hf, vllm, remote"),
])
def test_bad_vllm_settings_are_refused_by_name(env, words):
    with pytest.raises(ValueError) as caught:
        Settings.from_env(env)
    assert words in str(caught.value)


def test_engine_vllm_without_vllm_says_what_to_install(tiny_dir):
    pytest.importorskip("torch")
    try:
        import vllm  # noqa: F401
        pytest.skip("vLLM is installed here")
    except ImportError:
        pass
    with pytest.raises(CheckpointError, match="needs vLLM in this environment"):
        build_reader(Settings.of(engine="vllm", model=str(tiny_dir)))


def vllm_options(**changes):
    from app.build import vllm_options as from_settings

    return from_settings(Settings.of(**changes), "served", tiny=False)


def test_vllm_flags_follow_the_settings_with_extra_args_last(tmp_path):
    from app.engine.vllm.inprocess import engine_argv

    gpu = engine_argv(tmp_path, vllm_options(max_seqs=16, max_num_batched_tokens=8192, gpu_util=0.45,
                                              kv_cache_gb=24, extra_args="--async-scheduling --max-num-seqs 4"), True)
    joined = " ".join(gpu)
    for flag in ("--max-num-seqs 16", "--max-model-len 4096", "--enable-prefix-caching", "--max-num-batched-tokens 8192",
                 "--gpu-memory-utilization 0.45", f"--kv-cache-memory-bytes {24 * 2**30}",
                 "--attention-backend TRITON_ATTN", '--diffusion-config {"canvas_length": 128}'):
        assert flag in joined
    assert gpu[-3:] == ["--async-scheduling", "--max-num-seqs", "4"]  # EXTRA_ARGS win: they come last
    cpu = " ".join(engine_argv(tmp_path, vllm_options(), False))
    assert "--dtype float32" in cpu and "--attention-backend" not in cpu and "--gpu-memory" not in cpu


def test_a_read_past_the_window_warns_unless_the_backend_is_verified(caplog):
    from app.engine.base import ReaderInfo
    from app.engine.vllm.inprocess import VLLMReader

    info = ReaderInfo(model="m", engine="vllm", device="cpu", tiny=True, canvas_length=128)
    reader = VLLMReader(None, None, info, vllm_options(), window=64)  # type: ignore[arg-type]
    with caplog.at_level("WARNING", logger="djev.engine"):
        reader.warn_past_window(64)
        reader.warn_past_window(65)
        reader.window_verified = True
        reader.warn_past_window(500)
    warnings = [r for r in caplog.records if "passes the sliding window" in r.getMessage()]
    assert len(warnings) == 1 and reader.stats["reads_past_unverified_window"] == 1


def test_engine_remote_is_built_from_the_settings(tiny_dir):
    from app.engine.vllm.remote import RemoteReader

    reader = build_reader(Settings.of(engine="remote", upstream=("http://127.0.0.1:9/",), model=str(tiny_dir),
                                   upstream_read_timeout=7.0))
    assert isinstance(reader, RemoteReader) and reader.info.engine == "remote" and reader.info.tiny
    assert [u.url for u in reader.upstreams] == ["http://127.0.0.1:9"] and reader.pool.read_timeout == 7.0
    assert reader.tokenizer.vocab_size > 0 and not reader.ready  # not started: no upstream checked yet


def rendered_in_full(raw, form: ChatForm) -> str:
    """`form` through the checkpoint's chat template in one call, as vLLM renders the messages it is
    sent: what ChatFormer.render must give, however it caches the template."""
    messages = []
    for message in form.messages:
        content = message["content"]
        if isinstance(content, list):
            content = [{"type": "image"} if part == IMAGE_PART else {"type": "text", "text": part} for part in content]
        messages.append({"role": message["role"], "content": content})
    return raw.apply_chat_template(messages, tokenize=False, add_generation_prompt=not form.continue_final,
                                   continue_final_message=form.continue_final, enable_thinking=form.thinking)


def test_the_template_is_rendered_once_per_shape(tiny_dir, monkeypatch):
    tokenizer, raw = load_tokenizer(tiny_dir, CheckpointConfig.read(tiny_dir))
    chat = ChatFormer(tokenizer, tokenizer.image_placeholder_id)
    states = ("a photo of a cat", " padded <turn|> state \n", "a dog")
    prompts = [Prompt(tuple(tokenizer.render_chat("Question q1: is it?", state, 1, False))) for state in states]
    calls = []
    render = raw.apply_chat_template
    monkeypatch.setattr(raw, "apply_chat_template",
                        lambda *args, **kwargs: calls.append(1) or render(*args, **kwargs))
    for state, prompt in zip(states, prompts):
        assert chat.form(prompt).messages[1]["content"] == [IMAGE_PART, state]
    assert len(calls) == 1
    forms = [ChatForm(({"role": "system", "content": ""}, {"role": "user", "content": [IMAGE_PART, " x "]}),
                      True, False),
             ChatForm(({"role": "user", "content": "hi"}, {"role": "assistant", "content": "<|channel>thought\n"}),
                      False, True)]
    for form in forms:
        assert chat.render(form) == rendered_in_full(raw, form)


def test_a_template_that_changes_the_texts_is_rendered_in_full(tiny_dir):
    tokenizer, raw = load_tokenizer(tiny_dir, CheckpointConfig.read(tiny_dir))
    raw.chat_template = raw.chat_template.replace("{{ message['content'] }}", "{{ message['content'] | trim }}")
    chat = ChatFormer(tokenizer, tokenizer.image_placeholder_id)
    form = ChatForm(({"role": "system", "content": "rules"}, {"role": "user", "content": "  spaced  "}), False, False)
    assert chat.render(form) == rendered_in_full(raw, form)
    assert "spaced<turn|>" in chat.render(form)
