"""The HTTP server: three processes (tokenizer manager + HTTP, scheduler, detokenizer)."""
