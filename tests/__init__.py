"""attncc's tests; the folders mirror the packages (DEVELOPERS.md, "Tests")."""
