"""The downstream project the documentation's first test checks (a stand-in for yours)."""
