"""The Python API: submit a job, or generate over rows in memory."""
