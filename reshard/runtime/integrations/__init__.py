"""The framework integrations' runtime code; reached as ``reshard.integrations`` (its lazy entry)."""
