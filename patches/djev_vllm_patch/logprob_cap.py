"""Raise vLLM's cap on `logprob_token_ids` per request (128 in vLLM 0.32.0).

Why: a djev read asks for the log-probabilities of every label id of the canvas's questions; one
question may have 255 options, and vLLM refuses more than 128 ids per request. djev's engines split
such a read into several requests so that any stock vLLM answers it; where this plugin is known to
be loaded (the in-process engine, `status()["max_logprob_token_ids"]`), one request is enough.

The cap is the module global `MAX_LOGPROB_TOKEN_IDS` of `vllm.sampling_params` (request
validation) and a copy imported by name into `vllm.v1.worker.gpu.sample.logprob` (it sizes the
per-request id buffer and is checked again there). Both are set here, before the worker builds that
buffer (plugins load before the model runner). The buffer is `max_num_seqs x cap` int64s; the
logprobs that come back grow as ids x canvas width.

How to tell upstream no longer needs it: `vllm.sampling_params.MAX_LOGPROB_TOKEN_IDS` is gone or at
least 255 (then djev's 255-option test passes with DJEV_VLLM_PATCH_DISABLE=logprob_cap), or the
limit became a setting.
"""

from __future__ import annotations

import logging

log = logging.getLogger("vllm.djev_vllm_patch")


VLLM_CAP = 128  # vLLM 0.32.0's own value


def install(cap: int) -> None:
    import vllm.sampling_params as sampling_params
    import vllm.v1.worker.gpu.sample.logprob as worker_logprob

    previous = sampling_params.MAX_LOGPROB_TOKEN_IDS
    if previous >= cap:
        return
    sampling_params.MAX_LOGPROB_TOKEN_IDS = cap
    worker_logprob.MAX_LOGPROB_TOKEN_IDS = cap
    log.info("djev_vllm_patch: logprob_token_ids per request %d -> %d", previous, cap)


def uninstall() -> None:
    """Put vLLM's own cap back (tests compare before and after in one process)."""
    import vllm.sampling_params as sampling_params
    import vllm.v1.worker.gpu.sample.logprob as worker_logprob

    sampling_params.MAX_LOGPROB_TOKEN_IDS = VLLM_CAP
    worker_logprob.MAX_LOGPROB_TOKEN_IDS = VLLM_CAP
