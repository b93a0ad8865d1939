"""Third-party stacks (verl, HF Trainer, TRL) as subjects."""
