"""How far transformers' own half-precision logits are from its f32 ones on
the tiny fixtures: the bound relay's bf16 and f16 logits are held to in
shared/llm/tests/reference_models.rs (`HALF_TOLERANCES`), since a random-weight
model's logits move with the weights' rounding whatever computes them.

For each fixture, dtype and case, with and without its PEFT adapter: the
relative L2 gap ||half - f32|| / ||f32|| of the whole logits matrix, the
f32 logits being the fixture's reference.json (made by transformers in
f32). Prints one line per fixture and dtype, then one JSON line.

    python services/bench/hf/half_precision_gaps.py --fixtures ../shared/fixtures
"""

import argparse
import json

import peft
import torch
import transformers


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fixtures", required=True)
    args = parser.parse_args()
    out = {}
    for name in ["tiny-qwen2", "tiny-qwen3", "tiny-llama3"]:
        folder = f"{args.fixtures}/{name}"
        with open(f"{folder}/reference.json") as f:
            cases = json.load(f)["cases"]
        for dtype in [torch.bfloat16, torch.float16]:
            base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            model = peft.PeftModel.from_pretrained(base, f"{folder}/adapter").to(dtype).eval()
            worst = 0.0
            for case in cases:
                ids = torch.tensor([case["input_ids"]])
                for adapter, key in [(False, "logits"), (True, "logits_with_adapter")]:
                    with torch.no_grad():
                        if adapter:
                            got = model(ids).logits
                        else:
                            with model.disable_adapter():
                                got = model(ids).logits
                    want = torch.tensor(case[key])
                    gap = ((got.float()[0] - want).norm() / want.norm()).item()
                    worst = max(worst, gap)
            dtype_name = str(dtype).removeprefix("torch.")
            out.setdefault(name, {})[dtype_name] = worst
            print(f"{name} {dtype_name}: transformers' largest relative gap to its f32 logits {worst:.2e}")
    print(json.dumps({"bench": "half-precision-gaps", "transformers": transformers.__version__,
                      "torch": torch.__version__, "gaps": out}))


if __name__ == "__main__":
    main()
