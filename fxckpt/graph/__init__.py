"""Read-only facts about joint, forward and backward graphs."""
