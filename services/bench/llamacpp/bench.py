"""llama.cpp's side of `relay-bench bench-llamacpp` (llama-cpp-python, run
with the Python of .relay/llama-cpp that `bash deploy/install.sh
--llama-cpp` makes).

Reads JSON lines on stdin. The first one, {"prompt": [ids], "text": str,
"new_tokens": n}, sets the run up; the script answers with its version, the
system info llama.cpp was built with, and whether llama.cpp's tokenizer
gives the same ids for the text. Each later line runs one round: the KV
cache cleared, the prompt's ids fed in one llama_decode call and the first
token picked (prompt_s), then n greedy decode steps of one token each
(gen_s); the answer is {"prompt_s", "gen_s", "tokens"}. Ends at EOF.
"""

import argparse
import json
import sys
import time

import numpy as np
import llama_cpp


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="the .gguf file")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--n-ctx", type=int, default=512)
    args = parser.parse_args()

    llm = llama_cpp.Llama(
        model_path=args.model,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_batch=512,
        n_ubatch=512,
        n_ctx=args.n_ctx,
        seed=0,
        verbose=False,
    )
    n_vocab = llm.n_vocab()

    def greedy():
        # Only the last fed position has logits (logits_all is off).
        logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,))
        return int(np.argmax(logits))

    setup = json.loads(sys.stdin.readline())
    prompt = setup["prompt"]
    new_tokens = setup["new_tokens"]
    own = llm.tokenize(setup["text"].encode(), add_bos=False, special=False)
    print(
        json.dumps(
            {
                "version": llama_cpp.__version__,
                "system_info": llama_cpp.llama_print_system_info().decode().strip(),
                "own_tokenizer_same_ids": own == prompt,
                "own_tokenizer_tokens": len(own),
            }
        ),
        flush=True,
    )

    for _ in sys.stdin:
        llm.reset()  # the next eval drops every cached position
        started = time.perf_counter()
        llm.eval(prompt)
        token = greedy()
        prompt_s = time.perf_counter() - started
        tokens = [token]
        started = time.perf_counter()
        for _ in range(new_tokens):
            llm.eval([token])
            token = greedy()
            tokens.append(token)
        gen_s = time.perf_counter() - started
        print(json.dumps({"prompt_s": prompt_s, "gen_s": gen_s, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
