"""One job: its configuration resolved and checked, its parts built, the loop, its ending."""
