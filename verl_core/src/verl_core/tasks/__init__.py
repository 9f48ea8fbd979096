"""Built-in tasks: small, self-contained problems (data, tokenizer, model, reward) that run without downloads."""
