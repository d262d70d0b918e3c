"""Recording the reference: where each capture point lives, the hooks that capture it,
`moe-parity golden`, and tiny models."""
