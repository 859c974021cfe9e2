"""Writes a random-weight checkpoint of a given config.json with transformers,
as the Hugging Face Hub holds such a model: bf16 weights in safetensors
shards with model.safetensors.index.json. The set-up of
`relay-bench bench-hub-model`; nothing is downloaded.

Prints one JSON line: parameters, seconds to build and to save.
"""

import argparse
import json
import time

import torch
import transformers


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True, help="a config.json")
    parser.add_argument("--out", required=True, help="the model folder to write")
    parser.add_argument("--max-shard-size", default="2GB")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    with open(args.config) as f:
        fields = json.load(f)
    model_type = fields.pop("model_type")
    fields.pop("architectures", None)
    fields.pop("torch_dtype", None)
    config = transformers.AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(args.seed)
    started = time.time()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    built = time.time()
    model.save_pretrained(args.out, max_shard_size=args.max_shard_size)
    saved = time.time()
    print(
        json.dumps(
            {
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "parameters": sum(p.numel() for p in model.parameters()),
                "build_s": round(built - started, 1),
                "save_s": round(saved - built, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
