"""What tests and bench scripts share: the real sshd fleet, hubs, users, boards."""
