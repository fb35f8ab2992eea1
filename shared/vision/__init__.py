"""Images as every service sees them: their checks (a decompression bomb refused from its header)
and how many tokens each becomes (the router counts them, the encoder makes that many). The
pixels and the vision tower are the encoder's (services/encoder/)."""
