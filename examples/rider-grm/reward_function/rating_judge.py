"""A reward module in VeRL-with-RMs' format (rm_preprocess / rm_postprocess) with our own rule:
the judge rates the reply 0-10 and the score is that number / 10. Not VeRL-with-RMs'
rider_reward.py, whose judge fills a JSON rubric of 0/1 dimensions."""

import re


def rm_preprocess(text_prompts, text_responses, tgt_tokenizer):
    inputs = []
    for prompt, response in zip(text_prompts, text_responses):  # noqa: B905 (verbatim VeRL-with-RMs style)
        content = prompt.replace("{response}", response) if prompt else response
        messages = [{"role": "user", "content": content}]
        inputs.append(tgt_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return inputs


def rm_postprocess(results):
    scores = []
    for text in results:
        match = re.search(r"\d+(\.\d+)?", text)
        if match is None:
            raise ValueError("no number in the judge output")
        scores.append(min(float(match.group()), 10.0) / 10.0)
    return scores
