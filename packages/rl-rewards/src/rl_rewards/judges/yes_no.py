"""Yes/no judge: is the response a correct, helpful answer to the request?

A VeRL-with-RMs reward module (no rl_rewards imports). Score 1.0 when the judge's answer starts
with "yes", 0.0 otherwise (including "no" and unreadable output).
"""

QUESTION = (
    "Read the user request and the assistant response. Is the response a correct and helpful answer "
    "to the request? Answer with a single word: yes or no."
)


def rm_preprocess(text_prompts, text_responses, tgt_tokenizer):
    inputs = []
    for prompt, response in zip(text_prompts, text_responses, strict=True):
        content = f"{QUESTION}\n\n[Request]\n{prompt}\n\n[Response]\n{response}"
        messages = [{"role": "user", "content": content}]
        inputs.append(tgt_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return inputs


def rm_postprocess(results):
    return [1.0 if text.strip().lower().lstrip("*\"'").startswith("yes") else 0.0 for text in results]
