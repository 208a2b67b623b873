"""Notifications: gputop tells people when their GPUs are granted, when their time runs out
and when they waste, so nobody has to watch the board.

``notice`` holds what one notification is and where it may go (the contract between the
rooms below); ``events`` derives notices from state changes and time; ``channels`` formats
and sends them (mail, webhooks, ntfy); ``delivery`` queues, retries and counts them;
``routes`` keeps each person's own routes in the shared store.
"""
