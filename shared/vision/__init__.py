"""Images: their checks, how many tokens each becomes, and the vision tower that encodes them."""
