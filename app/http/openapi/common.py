"""What every part of the document shares."""

REF = "#/components/schemas/"
