"""JSON rubric judge: the judge rates a response 0-10 on a rubric and answers with JSON.

A VeRL-with-RMs reward module: plain functions, no rl_rewards imports, so it also loads in the
original system unchanged. Score = rating / 10; output without a parsable rating -> 0.0.
"""

import json
import re

RUBRIC = (
    "You are a strict grader. Rate the assistant response to the user request on a 0-10 scale for "
    "correctness, helpfulness and clarity. Reply with JSON only: "
    '{"reason": "<one sentence>", "score": <integer 0-10>}'
)


def rm_preprocess(text_prompts, text_responses, tgt_tokenizer):
    inputs = []
    for prompt, response in zip(text_prompts, text_responses, strict=True):
        messages = [
            {"role": "system", "content": RUBRIC},
            {"role": "user", "content": f"[Request]\n{prompt}\n\n[Response]\n{response}"},
        ]
        inputs.append(tgt_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return inputs


def _rating(text):
    text = re.sub(r"^```(?:json)?|```$", "", text.strip()).strip()
    start, end = text.find("{"), text.rfind("}")
    if start >= 0 and end > start:
        try:
            value = json.loads(text[start : end + 1]).get("score")
            if isinstance(value, (int, float)):
                return min(max(float(value), 0.0), 10.0)
        except (json.JSONDecodeError, AttributeError):
            pass
    match = re.search(r'"?score"?\s*[:=]\s*(\d+(?:\.\d+)?)', text)
    return min(float(match.group(1)), 10.0) if match else 0.0


def rm_postprocess(results):
    return [_rating(text) / 10.0 for text in results]
