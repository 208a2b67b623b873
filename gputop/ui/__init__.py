"""The board: a Textual app over the data layer. Only this package imports Textual."""
