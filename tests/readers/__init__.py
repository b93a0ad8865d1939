"""The readers: every log format into one exact frame."""
