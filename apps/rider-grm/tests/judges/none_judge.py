"""A VeRL-with-RMs style module whose rm_postprocess returns None for some outputs (a parser
that gives up): those samples fail and are counted, the others keep their scores."""


def rm_preprocess(text_prompts, text_responses, tgt_tokenizer):
    return [f"{p}\nReply: {r}\nScore it." for p, r in zip(text_prompts, text_responses, strict=True)]


def rm_postprocess(results):
    return [None if len(text) % 2 else 0.5 for text in results]
