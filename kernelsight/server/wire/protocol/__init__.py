"""vLLM's wire types, one module per endpoint family (import from the defining module; nothing is re-exported):
``openai`` (completions, chat), ``tokenize`` (/tokenize, /detokenize), ``lora`` (adapter loading), and
``version`` (the vLLM release spoken and its request limits)."""
