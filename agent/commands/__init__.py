"""One module per ``infire-agent`` subcommand; each defines ``register(subparsers)``.

Modules import heavy dependencies (torch, boto3) inside their command function so that
``infire-agent --help`` stays fast.
"""
