"""A reward module in the VeRL-with-RMs style (plain functions, no imports of ours), for tests:
its score is read off the judge's raw text, and some texts are unreadable, so a random tiny
judge gives both scores and per-sample parse failures."""


def rm_preprocess(text_prompts, text_responses, tgt_tokenizer):
    return [
        tgt_tokenizer.apply_chat_template([{"role": "user", "content": f"{p}\nReply: {r}\nScore it."}],
                                          tokenize=False, add_generation_prompt=True)
        for p, r in zip(text_prompts, text_responses, strict=True)
    ]


def rm_postprocess(results):
    scores = []
    for text in results:
        if len(text) % 2 == 1:
            raise ValueError(f"unreadable judge output {text!r}")
        scores.append(len(text) % 10 / 10)
    return scores
