//! K3's XTML chat format: rendering conversations and parsing generated output.
