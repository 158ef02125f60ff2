"""torch's requirements for the image's machine, one a line, their markers judged for that machine (pip on the host
would judge `platform_machine` by the host's). make-base-image.sh runs it with the host's python3:

    python3 torch_requirements.py TORCH_WHEEL QEMU_ARCH
"""

import sys
import zipfile
from email.parser import Parser

from pip._vendor.packaging.requirements import Requirement

wheel, machine = sys.argv[1:3]
target = {"platform_machine": machine, "platform_system": "Linux", "sys_platform": "linux", "extra": ""}
with zipfile.ZipFile(wheel) as archive:
    metadata = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
    for line in Parser().parsestr(archive.read(metadata).decode()).get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate(target):
            requirement.marker = None
            print(requirement)
