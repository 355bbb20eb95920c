"""What the simulated model reads and writes: tokenizer, prompts, output tokens, logprobs, structured outputs,
tool calls."""
