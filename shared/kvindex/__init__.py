"""The KV block index as the KV event stream builds it: kept by cachemeta (the authority on
what is deleted) and by every router (which routes by its own copy, with no lookup hop)."""
