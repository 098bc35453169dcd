"""The spec language's grammar, `schedc.lark` (package data, read by `schedc.parse`)."""
