"""A VeRL-with-RMs style module for golden tables: the judge model really generates, but the
score is the judged response itself read as a number ("0.8" -> 0.8), so a test can choose
each sample's judge score. rm_preprocess keeps the responses of the batch it was given;
rm_postprocess scores them in the same order (the judge's text is ignored)."""

_responses: list[str] = []


def rm_preprocess(text_prompts, text_responses, tgt_tokenizer):
    _responses[:] = text_responses
    return [f"{p.replace('{response}', r)}\nScore it." for p, r in zip(text_prompts, text_responses, strict=True)]


def rm_postprocess(results):
    return [float(r) for r in _responses[: len(results)]]
