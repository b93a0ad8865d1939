"""The project as a whole: layering, installation, the GPU check, security scans."""
