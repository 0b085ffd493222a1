"""optimum CLI registration (PEP 420 namespace ``optimum.commands.register``, shipped by
aipc-plugins): adds ``optimum-cli export openvino-npu``. Kept light: the exporter is imported
when the command runs."""
from optimum.commands.base import BaseOptimumCLICommand, CommandInfo
from optimum.commands.export.base import ExportCommand


class OVNPUExportCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(name="openvino-npu", help="Export a causal LM to chunked, stateful, "
                          "static-shape OpenVINO IRs for Intel NPUs (optimum_npu).")

    @staticmethod
    def parse_args(parser):
        from optimum_npu.cli import add_arguments

        add_arguments(parser)

    def run(self):
        from optimum_npu.cli import run

        run(self.args)


REGISTER_COMMANDS = [(OVNPUExportCommand, ExportCommand)]
