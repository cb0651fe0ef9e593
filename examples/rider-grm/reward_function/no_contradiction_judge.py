"""A reward module in VeRL-with-RMs' format (rm_preprocess / rm_postprocess) with our own rule:
the judge answers whether the reply contradicts the prompt; "No" (no contradiction) scores 1,
"Yes" scores 0. Not VeRL-with-RMs' consistency_reward.py, whose judge fills a JSON rubric."""


def rm_preprocess(text_prompts, text_responses, tgt_tokenizer):
    return [
        tgt_tokenizer.apply_chat_template(
            [{"role": "user", "content": p.replace("{response}", r)}], tokenize=False, add_generation_prompt=True
        )
        for p, r in zip(text_prompts, text_responses)  # noqa: B905 (verbatim VeRL-with-RMs style)
    ]


def rm_postprocess(results):
    out = []
    for text in results:
        t = text.strip().lower()
        if t.startswith("no"):
            out.append(1.0)
        elif t.startswith("yes"):
            out.append(0.0)
        else:
            raise ValueError(f"expected Yes or No, got {text[:40]!r}")
    return out
