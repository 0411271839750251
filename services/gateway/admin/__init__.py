"""The admin API and the console."""
