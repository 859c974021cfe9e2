"""The GPU check's summary (deploy/gpu-check.sh): relay's numbers beside
their anchors' in two tables, then one JSON line, also written to
$OUT_DIR/gpu-check.json. Reads what the script collected from the
environment: the JSON lines of bench-gpu (RELAY_JSON), generate_anchor.py
(ANCHOR_JSON), bench-cnn-step (CNN_JSON) and cnn_step_anchor.py
(CNN_ANCHOR_JSON), each "null" when its step gave none; the steps'
outcomes (STATUS, "name=outcome ..."), the reference tests' largest gaps
(REFERENCE_GAPS, a line each), the GPU (GPU) and the bundle's manifest
(MANIFEST).

Only the standard library: it runs on the dry run's python too.
"""

import json
import os


def loaded(name):
    return json.loads(os.environ.get(name) or "null")


def generate_rows(relay, anchor):
    theirs = {r["batch"]: r["tokens_per_s"] for r in (anchor or {}).get("generate_tokens_per_s", [])}
    rows = []
    for backend in (relay or {}).get("backends", []):
        for r in backend["generate_tokens_per_s"]:
            t = theirs.get(r["batch"])
            rows.append(
                {
                    "backend": backend["backend"],
                    "batch": r["batch"],
                    "relay_tokens_per_s": r["tokens_per_s"],
                    "transformers_tokens_per_s": t,
                    "ratio": round(r["tokens_per_s"] / t, 2) if t else None,
                }
            )
    return rows


def print_generate(relay, rows):
    print("| backend | B | relay tok/s | transformers tok/s | relay / transformers |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['backend']} | {r['batch']} | {r['relay_tokens_per_s']} | "
            f"{r['transformers_tokens_per_s'] or '-'} | {r['ratio'] or '-'} |"
        )
    for backend in (relay or {}).get("backends", []):
        if "warm_up_s" in backend:
            print(f"({backend['backend']}: warm-up generate at B=1, untimed, {backend['warm_up_s']} s)")


def print_cnn(cnn, cnn_anchor):
    """relay's step, then each of PyTorch's settings, with relay's ratio to it."""
    print()
    print(f"| NatureCNN PPO step, batch {cnn['batch']} | check (largest gap) | samples/s | relay / this |")
    print("|---|---|---:|---:|")
    gap = max(cnn["loss_gap"], cnn["grad_norm_gap"], cnn["parameter_gap"])
    print(f"| relay ({cnn['device']}) | {cnn['check']} ({gap:.1e}) | {cnn['samples_per_s']:.0f} | 1.00 |")
    for s in (cnn_anchor or {}).get("settings", []):
        tf32 = "cuDNN TF32 on" if s["cudnn_tf32"] else "TF32 off"
        ratio = cnn["samples_per_s"] / s["samples_per_s"] if s["samples_per_s"] else None
        print(
            f"| PyTorch {s['setting']} ({s['frames']}, {tf32}) | - | {s['samples_per_s']:.0f} | "
            f"{f'{ratio:.2f}' if ratio else '-'} |"
        )


def main():
    relay, anchor = loaded("RELAY_JSON"), loaded("ANCHOR_JSON")
    cnn, cnn_anchor = loaded("CNN_JSON"), loaded("CNN_ANCHOR_JSON")
    status = dict(s.split("=", 1) for s in os.environ.get("STATUS", "").split())
    with open(os.environ["MANIFEST"]) as f:
        manifest = json.load(f)
    rows = generate_rows(relay, anchor)
    print_generate(relay, rows)
    if cnn:
        print_cnn(cnn, cnn_anchor)
    summary = {
        "check": "gpu",
        "gpu": os.environ.get("GPU"),
        "bundle": manifest,
        "steps": status,
        "reference_gaps": [g for g in os.environ.get("REFERENCE_GAPS", "").splitlines() if g],
        "generate": rows,
        "relay": relay,
        "anchor": anchor,
        "cnn_step": cnn,
        "cnn_anchor": cnn_anchor,
    }
    line = json.dumps(summary)
    with open(os.path.join(os.environ["OUT_DIR"], "gpu-check.json"), "w") as f:
        f.write(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
