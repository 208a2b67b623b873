"""Jobs on reserved GPUs: waiting in the queue, `gputop run`, releasing when a job ends."""
