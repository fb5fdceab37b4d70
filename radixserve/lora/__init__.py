"""LoRA serving: adapters read from PEFT folders, applied per request within one batch."""
