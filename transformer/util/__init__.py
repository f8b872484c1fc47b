"""Command-line plumbing: flags and one-line errors, text input, progress, plotting, and
atomic file writes (local or remote)."""
