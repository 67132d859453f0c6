"""Plain dataclasses shared by every layer; standard library only."""
