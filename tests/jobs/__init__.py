"""Programs the tests run: loops, jobs and the HF callback run."""
