"""Reading users' folders of C++/CUDA code as they are laid out (discovery, setup.py,
CMake, a package importing ``_C``, kernel-builder projects): each picks the route
``opforge build PATH`` takes and hands the engine (``opforge.builder``) a recipe.
The engine never imports this package."""
