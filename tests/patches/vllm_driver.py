"""Runs vLLM work for tests/patches/ inside .venv-vllm (vLLM is not installed in .venv).

    .venv-vllm/bin/python tests/patches/vllm_driver.py JOB.json RESULT.json

JOB.json: {"model": DIR, "engine": {LLM keyword overrides}, "steps": [...]} where each step is one of
  {"op": "reads", "name": N, "reads": [READ, ...]}   all canvases of all reads submitted together
  {"op": "uninstall", "patch": "canvas_window" | "logprob_cap"}
  {"op": "note_backends", "names": [backend, ...]}
  {"op": "status", "name": N}
and READ = {"prompt": [ids], "canvases": [[ids]], "slots": [pos], "label_ids": [[ids] per slot]}.
RESULT.json: {N: [per read: [per canvas: [per slot: [logprob per label id]]]] or {"error": text}, ...}.

One vLLM engine per run (a fresh one costs ~25 s here), float32, eager, one-step read-only reads.
"""

from __future__ import annotations

import json
import sys
import time


def request(read: dict, canvas: list[int]):
    from vllm import SamplingParams

    ids = sorted({i for labels in read["label_ids"] for i in labels})
    params = SamplingParams(
        max_tokens=len(canvas),
        logprobs=len(ids),
        logprob_token_ids=ids,
        extra_args={
            "diffusion_seed_canvas": list(canvas),
            "diffusion_canvas_length": len(canvas),
            "diffusion_max_steps": 1,
            "diffusion_read_only": True,
        },
    )
    return {"prompt_token_ids": list(read["prompt"])}, params


def run_reads(llm, reads: list[dict]):
    prompts, params, where = [], [], []
    for r, read in enumerate(reads):
        for c, canvas in enumerate(read["canvases"]):
            prompt, sampling = request(read, canvas)
            prompts.append(prompt)
            params.append(sampling)
            where.append((r, c))
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    except Exception as exc:  # the tests assert on vLLM's refusal text
        return {"error": f"{type(exc).__name__}: {exc}"}
    results = [[None] * len(read["canvases"]) for read in reads]
    for (r, c), output in zip(where, outputs):
        positions = output.outputs[0].logprobs
        read = reads[r]
        results[r][c] = [
            [positions[slot][label].logprob for label in labels]
            for slot, labels in zip(read["slots"], read["label_ids"])
        ]
    return results


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    started = time.monotonic()
    from vllm import LLM

    import djev_vllm_patch

    engine = dict(dtype="float32", enforce_eager=True, max_model_len=1024, max_num_seqs=8,
                  max_num_batched_tokens=1024, seed=0,
                  limit_mm_per_prompt={"image": 0, "video": 0, "audio": 0})
    engine.update(job.get("engine", {}))
    llm = LLM(model=job["model"], **engine)
    result: dict = {"startup_s": time.monotonic() - started}
    for step in job["steps"]:
        if step["op"] == "reads":
            t0 = time.monotonic()
            result[step["name"]] = run_reads(llm, step["reads"])
            result[step["name"] + "_s"] = time.monotonic() - t0
        elif step["op"] == "uninstall":
            djev_vllm_patch.uninstall(step["patch"])
        elif step["op"] == "note_backends":  # what the start-up check does with a model's backends
            djev_vllm_patch.note_backends(step["names"])
        elif step["op"] == "status":
            result[step["name"]] = djev_vllm_patch.status()
        else:
            raise ValueError(f"unknown op {step['op']!r}")
    with open(sys.argv[2], "w") as out:
        json.dump(result, out)


if __name__ == "__main__":
    main()
