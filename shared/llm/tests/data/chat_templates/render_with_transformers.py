"""Renders the cases below with transformers' apply_chat_template and writes
expected.json, which shared/llm/tests/chat_templates.rs compares relay's
rendering with. Run from this folder with a Python that has transformers
(`bash deploy/install.sh --transformers` puts one in .relay/sb3):

    ../../../../../.relay/sb3/bin/python render_with_transformers.py

The tokenizer only supplies apply_chat_template; every template variable
the templates read is passed explicitly.
"""

import json
import pathlib

import transformers

HERE = pathlib.Path(__file__).parent
TOKENIZER = HERE / "../../../../../../shared/fixtures/tiny-qwen2"

SYSTEM = {"role": "system", "content": "You are playing TicTacToe as X."}
USER = {"role": "user", "content": "The board:\n[ ][X][ ]\n[ ][O][ ]\n[ ][ ][ ]\nYour move?"}
THOUGHT = {
    "role": "assistant",
    "content": "<think>\nThe centre is taken, so a corner.\n</think>\n\n\\boxed{0}",
}
REPLY = {"role": "assistant", "content": "  [4]  "}
USER2 = {"role": "user", "content": "And now?"}

CASES = {
    "qwen3.jinja": [
        ("one user turn", [USER], True, {}),
        ("thinking off", [SYSTEM, USER], True, {"enable_thinking": False}),
        ("thinking on", [SYSTEM, USER], True, {"enable_thinking": True}),
        ("earlier thought dropped", [SYSTEM, USER, THOUGHT, USER2], True, {}),
        ("last turn keeps its thought", [USER, THOUGHT], False, {}),
    ],
    "llama3.1.jinja": [
        (
            "system and user",
            [SYSTEM, USER],
            True,
            {"bos_token": "<|begin_of_text|>", "date_string": "26 Jul 2024"},
        ),
        (
            "no system, several turns",
            [USER, REPLY, USER2],
            True,
            {"bos_token": "<|begin_of_text|>", "date_string": "28 Nov 2026"},
        ),
        (
            "no generation prompt",
            [SYSTEM, USER, REPLY],
            False,
            {"bos_token": "<|begin_of_text|>", "date_string": "26 Jul 2024"},
        ),
    ],
}


def main():
    tokenizer = transformers.AutoTokenizer.from_pretrained(TOKENIZER)
    out = {"transformers": transformers.__version__, "templates": {}}
    for template_file, cases in CASES.items():
        template = (HERE / template_file).read_text()
        rendered = []
        for name, messages, add_generation_prompt, kwargs in cases:
            text = tokenizer.apply_chat_template(
                messages,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
            rendered.append(
                {
                    "name": name,
                    "messages": messages,
                    "add_generation_prompt": add_generation_prompt,
                    "kwargs": kwargs,
                    "text": text,
                }
            )
        out["templates"][template_file] = rendered
    (HERE / "expected.json").write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
