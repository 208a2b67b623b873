"""How a notice is said in each format (``formats``) and how it is carried (``send``: SMTP
and HTTP POST). Every text in a notice may be hostile: each format escapes it for itself
and bounds its length."""
