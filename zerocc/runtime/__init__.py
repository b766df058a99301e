"""What the emitted program calls and the state it keeps between steps."""
