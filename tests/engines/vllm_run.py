"""Greedy vLLM runs of a target, without and with an EAGLE-3 head; outputs and speculative counters as JSON.

Runs INSIDE the vLLM venv (see vllm_env.py), never in mmspec's::

    .venv-vllm/bin/python tests/engines/vllm_run.py --target DIR --head DIR [DIR ...]|none --prompts prompts.json \\
        --max-tokens 40 --spec-tokens 3 --out result.json [--dtype float32] [--skip-tokenizer]

``prompts.json`` is a list of token-id lists. Each configuration ("base": no speculation; "eagle3": the head when
one is given, "eagle3:<folder name>" for each of several) runs one ``vllm.LLM`` in its own child process (a fresh
engine and metrics registry each), greedy (temperature 0, stops at EOS), prompts as ``{"prompt_token_ids": ids}``,
``enforce_eager=True``. The result JSON: ``{"vllm_version", "wall_s", "configs": {name: {"outputs", "start_s",
"generate_s", "wall_s", "spec": {...}} or {"error", "wall_s"}}}`` where ``spec``
holds the counters read from ``llm.get_metrics()``: ``vllm:spec_decode_num_drafts``,
``vllm:spec_decode_num_draft_tokens``, ``vllm:spec_decode_num_accepted_tokens`` (Counters) and
``vllm:spec_decode_num_accepted_tokens_per_pos`` (Vector), plus ``mean_acceptance_length = 1 + accepted / drafts``.
``VLLM_CPU_KVCACHE_SPACE`` defaults to 1 (GiB) here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

METRICS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
           "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
           "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_pos"}
ERROR_LINE = re.compile(r"\b\w*(Error|Exception): .*")


def spec_counters(metrics) -> dict:
    """The speculative-decoding counters of ``llm.get_metrics()`` (summed over engines), and the mean acceptance."""
    out = {}
    for m in metrics:
        key = METRICS.get(m.name)
        if key == "accepted_per_pos":
            prev = out.get(key, [0] * len(m.values))
            out[key] = [a + b for a, b in zip(prev, m.values)]
        elif key:
            out[key] = out.get(key, 0) + m.value
    if out.get("drafts"):
        out["mean_acceptance_length"] = 1 + out["accepted_tokens"] / out["drafts"]
    return out


def head_configs(heads: list[str]) -> list[tuple[str, str]]:
    """(configuration name, head folder): "eagle3" for a single head, "eagle3:<folder name>" for several."""
    heads = [h for h in heads if h.lower() != "none"]
    if len(heads) == 1:
        return [("eagle3", heads[0])]
    return [(f"eagle3:{os.path.basename(os.path.normpath(h))}", h) for h in heads]


def run_one(args, name: str) -> dict:
    """One configuration in this process: start the engine, generate, read the counters."""
    from vllm import LLM, SamplingParams

    heads = dict(head_configs(args.head))
    spec = None
    if name != "base":
        spec = {"method": "eagle3", "model": heads[name], "num_speculative_tokens": args.spec_tokens}
    prompts = json.load(open(args.prompts))
    t0 = time.perf_counter()
    llm = LLM(model=args.target, dtype=args.dtype, enforce_eager=True, max_model_len=args.max_model_len, seed=0,
              disable_log_stats=False, speculative_config=spec, skip_tokenizer_init=args.skip_tokenizer)
    t1 = time.perf_counter()
    eos = json.load(open(os.path.join(args.target, "config.json"))).get("eos_token_id")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=False,
                            detokenize=not args.skip_tokenizer,  # no tokenizer: name the EOS id explicitly
                            stop_token_ids=([eos] if isinstance(eos, int) else eos) if args.skip_tokenizer else None)
    results = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    t2 = time.perf_counter()
    return {"outputs": [list(r.outputs[0].token_ids) for r in results], "speculative_config": spec,
            "start_s": round(t1 - t0, 2), "generate_s": round(t2 - t1, 2), "spec": spec_counters(llm.get_metrics())}


def run_child(cmd) -> tuple[int, str | None]:
    """Run ``cmd``, echoing its output to stderr; return its exit code and the first ``SomethingError: ...`` line."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    error = None
    for line in proc.stdout:
        sys.stderr.write(line)
        found = ERROR_LINE.search(line)
        if error is None and found:
            error = found.group(0).strip()
    return proc.wait(), error


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--head", nargs="+", default=["none"], help="EAGLE-3 head folder(s), or 'none'")
    p.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--spec-tokens", type=int, default=3)
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--skip-tokenizer", action="store_true", help="no tokenizer: token ids only, no detokenizing")
    p.add_argument("--only", help=argparse.SUPPRESS)  # internal: run one configuration in this process
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    if args.only:  # child: one engine, result to --out
        json.dump(run_one(args, args.only), open(args.out, "w"))
        return {}

    import vllm

    start = time.perf_counter()
    names = ["base"] + [name for name, _ in head_configs(args.head)]
    result = {"vllm_version": vllm.__version__, "target": args.target, "head": args.head,
              "max_tokens": args.max_tokens, "spec_tokens": args.spec_tokens, "dtype": args.dtype, "configs": {}}
    argv = sys.argv[1:] if argv is None else list(argv)
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            part = os.path.join(tmp, "part.json")
            t0 = time.perf_counter()
            cmd = [sys.executable, os.path.abspath(__file__), *argv, "--only", name, "--out", part]
            returncode, error = run_child(cmd)  # a later --out overrides the parent's
            wall = round(time.perf_counter() - t0, 2)
            if returncode != 0:
                result["configs"][name] = {"error": error or f"exit code {returncode}", "wall_s": wall}
                continue
            result["configs"][name] = json.load(open(part)) | {"wall_s": wall}
    result["wall_s"] = round(time.perf_counter() - start, 2)
    json.dump(result, open(args.out, "w"), indent=1)
    return result


if __name__ == "__main__":
    res = main()
    for name, conf in res.get("configs", {}).items():
        print(name, json.dumps({k: v for k, v in conf.items() if k != "outputs"}))
    sys.exit(0 if all("error" not in c for c in res.get("configs", {}).values()) else 1)
