// The one translation unit that compiles stb_image_write's implementation (libstb-dev, public domain).
#define STB_IMAGE_WRITE_IMPLEMENTATION
#include <stb/stb_image_write.h>
