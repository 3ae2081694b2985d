"""The fixes' base: errors, the atomic writer and paths (file_io), process groups, the HTTP client, compat."""
