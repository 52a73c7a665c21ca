"""What users import (as ``fragflow``): fragments, versioned state, environments, buffers, random keys, logging."""
