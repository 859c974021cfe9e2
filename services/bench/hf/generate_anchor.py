"""The anchor of `relay-bench bench-gpu` on a GPU: transformers' `generate`
on the same model folder, the same prompts (the token ids bench-gpu makes
for a model without a tokenizer) and the same lengths, sampling at
temperature 1 with no stop token, in bf16 on cuda:0. A warm-up generate
first, then each batch size timed from the call to its return (CUDA
synchronised on both sides).

Prints one line per batch size, then one JSON line.
"""

import argparse
import json
import time

import torch
import transformers

# bench_gpu.rs's SYNTHETIC_PROMPT_TOKENS and synthetic_prompt.
PROMPT_TOKENS = 48


def synthetic_prompt(vocab, k):
    return [(k * 7919 + i * 104_729 + 1) % vocab for i in range(PROMPT_TOKENS)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a Hugging Face model folder")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--device", default="cuda:0")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device)
    model.eval()
    vocab = model.config.vocab_size

    def run(batch):
        ids = torch.tensor([synthetic_prompt(vocab, k) for k in range(batch)], device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                pad_token_id=0,
            )
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        assert out.shape == (batch, PROMPT_TOKENS + args.new_tokens), out.shape
        return batch * args.new_tokens / seconds

    run(1)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        tps = run(batch)
        print(f"  transformers {transformers.__version__} B={batch:<3} {tps:>9.1f} tokens/s", flush=True)
        rows.append({"batch": batch, "tokens_per_s": round(tps, 1)})
    print(
        json.dumps(
            {
                "anchor": "transformers.generate",
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "dtype": str(dtype).removeprefix("torch."),
                "new_tokens": args.new_tokens,
                "prompt_tokens": PROMPT_TOKENS,
                "generate_tokens_per_s": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
