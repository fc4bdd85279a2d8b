"""What compiled graphs call at every step. Imports nothing from the compile-time side."""
