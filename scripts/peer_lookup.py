"""llama.cpp's prompt-lookup mode beside its plain greedy decode, for scripts/bench_speculative.py
(never in CI). Runs in the llama-cpp-python venv (/work/peer-venv: no twice, no torch):

    /work/peer-venv/bin/python scripts/peer_lookup.py JOB.json

JOB.json: {"gguf": path, "threads": n, "new_tokens": n, "rounds": n, "num_pred_tokens": n,
"max_ngram_size": n, "prompts": {name: [token ids]}} (the ids twice's tokenizer and chat template
made, so both engines start from the same tokens). For each prompt and round, plain then lookup
(llama_cpp.llama_speculative.LlamaPromptLookupDecoding through Llama.generate, greedy: top_k 1,
temp 0), each from an empty cache; decode tok/s = (new tokens - 1) / (time of the last token -
time of the first). Prints one JSON object on stdout: {name: {"plain": [...], "lookup": [...],
"plain_tokens": [...], "lookup_tokens": [...]}}.
"""

from __future__ import annotations

import json
import sys
import time


def run_one(llm, ids: list[int], new_tokens: int) -> tuple[float, list[int]]:
    llm.reset()
    out, t_first = [], None
    for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(token))
        if t_first is None:
            t_first = time.perf_counter()
        if len(out) >= new_tokens:
            break
    end = time.perf_counter()
    return ((len(out) - 1) / (end - t_first) if len(out) > 1 and end > t_first else 0.0), out


def main() -> None:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    job = json.loads(open(sys.argv[1]).read())
    common = dict(model_path=job["gguf"], n_ctx=4096, n_threads=job["threads"], n_threads_batch=job["threads"],
                  n_batch=2048, n_ubatch=512, verbose=False)
    plain = Llama(**common)
    lookup = Llama(**common, draft_model=LlamaPromptLookupDecoding(max_ngram_size=job.get("max_ngram_size", 2),
                                                                   num_pred_tokens=job.get("num_pred_tokens", 10)))
    report = {}
    for name, ids in job["prompts"].items():
        r = {"plain": [], "lookup": []}
        run_one(plain, ids, 4)  # warm-up
        for _ in range(job.get("rounds", 1)):
            for mode, llm in (("plain", plain), ("lookup", lookup)):
                rate, tokens = run_one(llm, ids, job["new_tokens"])
                r[mode].append(rate)
                r[f"{mode}_tokens"] = tokens
        report[name] = r
    print(json.dumps(report))


if __name__ == "__main__":
    main()
